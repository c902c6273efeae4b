"""The package version, in a module of its own so that the jobs can record it in manifests
without importing the package root (which imports the job).

    from reshard.version import __version__
"""
__version__ = "0.1.0"
