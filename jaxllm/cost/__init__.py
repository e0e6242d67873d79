"""The cost model: a train step compiled from shapes alone, read for its memory, FLOPs and
collectives, set beside the analytic traffic, and turned into a predicted step time on a
hardware profile; what `jaxllm.analyze` reports and `jaxllm.tune` ranks meshes by."""
