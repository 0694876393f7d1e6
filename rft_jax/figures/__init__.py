"""The paper's empirical claims at demo scale: ``rft-jax figures`` (:func:`make_figures`)."""

from rft_jax.figures.make import make_figures
from rft_jax.figures.runs import FULL, QUICK, FigureSettings

__all__ = ["FULL", "QUICK", "FigureSettings", "make_figures"]
