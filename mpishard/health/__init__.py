"""What keeps a job from hanging silently, and the process settings the library may change:
the watchdog and its guard thread, arrival counters, the flight recorder, the straggler line,
signal and uncaught-exception handling, debug mode's signature check, traces, BLAS threads and
the host heap. The engine passes its pieces to the Comm (comm/ is the transport below)."""
