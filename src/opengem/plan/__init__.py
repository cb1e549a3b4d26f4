"""Planner and simulator: lay out a GEM model on a cluster and predict its step time, memory and MFU.

``cluster`` (TOML cluster descriptions), ``calibration`` (measured kernel efficiencies), ``workload``
(what one sample of a preset costs), ``comm`` (bytes and times of the collectives), ``cost`` (memory and
step time of one layout), ``planner`` (enumerate, rank, report) and ``calibrate`` (the GPU measurements).
"""
