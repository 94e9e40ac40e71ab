"""YAIE: Yet Another Inference Engine, the course package.

The lesson modules (``yaie.kernels.*``) are yours to fill in; ``yaie.switch`` decides, lesson by
lesson, whether your module or the reference in ``solutions/`` runs.
"""

__version__ = "0.1.0"
