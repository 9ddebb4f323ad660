"""``python -m lmtier.bench.ttft`` = ``lmtier bench ttft``."""

from lmtier.bench.ttft import main

raise SystemExit(main())
