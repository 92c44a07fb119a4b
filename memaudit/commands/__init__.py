"""One module per CLI command group. Modules import only light dependencies at import time."""
