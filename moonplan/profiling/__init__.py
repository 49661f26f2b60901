"""Reports of :mod:`moonplan.profile`: gathering, statistics, Chrome trace, phase-bar plot.

``gather`` collects every rank's spans; ``report`` holds them and computes the
per-rank and critical-path figures (table, JSON); ``chrome`` writes the Chrome
trace; ``plot`` draws the stacked phase bars (needs matplotlib).
"""
