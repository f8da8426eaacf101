"""Transport: the device mesh, collectives and point-to-point on mpi4py, array backends.
What bounds and records the waits is passed in (health/)."""
