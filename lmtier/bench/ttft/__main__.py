"""``python -m lmtier.bench.ttft`` = ``lmtier bench ttft``."""

from lmtier.bench.ttft import main
from lmtier.bench.signals import exit_on_sigterm

exit_on_sigterm()
raise SystemExit(main())
