"""The profile phase (04) around the traces: the profiled windows through the engine's profiler endpoints
(capture, window), every level captured (capturephase), each level analysed and its records written
(levels), and an attached server's profile and the guard that sizes its window (attach, attachguard). Trace
analysis itself lives in decodescope.trace, the critical path in decodescope.critpath."""
