"""Communication: the device mesh, collectives and point-to-point on mpi4py, array backends."""
