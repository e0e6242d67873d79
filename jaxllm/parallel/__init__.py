"""How arrays are split over the device mesh and moved: the mesh, the rules a run shards by,
ZeRO's optimizer-state layout, collective rings and the pipelines' weight gathers. Nothing here
imports the model."""
