"""Pipeline parallelism over the pipe mesh axis, above the model it runs: `spec` (the shape and
stage order), `ticks` (schedules as tables), `gpipe` (GPipe and circular as a scan) and
`one_f_one_b` (1F1B and interleaved 1F1B)."""
