"""``python -m lmtier.bench.ttft`` = ``lmtier bench ttft``."""

from lmtier.bench.signals import exit_on_sigterm
from lmtier.bench.ttft import main

exit_on_sigterm()
raise SystemExit(main())
