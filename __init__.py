"""scratchd: a line-side inference daemon for surface-defect inspection.

The repository root is this package; its folders are the subpackages
`daemon`, `ipc`, `workers`, `kernels` and `dataset` (see pyproject.toml).
"""

__version__ = "0.1.0"
