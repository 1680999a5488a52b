"""What the Spark tests share: the JVM options that make a Spark JVM start fast."""

from __future__ import annotations

#: Every Spark JVM of the tests (the in-process session, killed drivers, `sbus analyze`,
#: the cluster's master, worker, driver and executor) compiles with C1 only: their jobs
#: are tiny and short, so C2's optimising compiles cost more CPU (on 2 cores, beside the
#: test itself) than they save.  Measured: a cold session and its first queries take
#: about 30% less wall time.  Tuning only; what Spark computes is unchanged.
FAST_JVM = "-XX:TieredStopAtLevel=1"
