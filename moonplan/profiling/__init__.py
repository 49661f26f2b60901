"""The profiler: ``session`` (its context manager is public as ``moonplan.profile``) and
its reports.

``session`` times the phases of MoonMoE steps and finds the runtimes in a model;
``gather`` collects every rank's spans; ``report`` holds them and computes the
per-rank and critical-path figures (table, JSON); ``chrome`` writes the Chrome
trace; ``plot`` draws the stacked phase bars (needs matplotlib).
"""
