"""Several tests compare two runs bit for bit (a resumed run against an uninterrupted one), so torch's CPU
thread count must not change between them. ``posttrain.trainers.threads.configure`` picks it from the 1-minute
load average at the start of every run unless ``OMP_NUM_THREADS`` is set. nox sets it; a bare ``pytest`` gets
the same pin here. Without it, a reference run on 2 threads and a resume on 1 differed in the last bit of a
gradient norm."""

import os

os.environ.setdefault("OMP_NUM_THREADS", "2")
