"""How arrays are split over the device mesh: the mesh, the rules a run shards by, the
pipeline over the pipe axis, ZeRO's optimizer-state layout."""
