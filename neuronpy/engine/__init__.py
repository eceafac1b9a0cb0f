"""Per-model engine task (admission, join/leave, lockstep steps, sampling) and per-slot routers."""
