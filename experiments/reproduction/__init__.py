"""What `experiments.reproduce` reports, beside the paper's numbers.

`paper` holds the paper's figures and case-study plans; `sizes` weighs
per-stage micro-batch sizes at shares of the preset's memory; `report`
writes REPRODUCTION.md (and the site's results page) from results.json, with
the case study's section in `case`, the branch sweep's in `sweep` and the
sections that are not paper figures in `extras`; `figures` draws the PNGs.
"""
