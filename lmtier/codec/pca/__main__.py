"""``python -m lmtier.codec.pca``: :func:`lmtier.codec.pca.calibrate.main`."""

import sys

from lmtier.codec.pca.calibrate import main

if __name__ == "__main__":
    sys.exit(main())
