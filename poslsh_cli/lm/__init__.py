"""Models and data: model references (``models``), checkpoint files (``checkpoint``), loading and
capturing q/k/v (``capture``), position schemes (``positions``), installed into transformers models
(``install``), models built and loaded with one (``loading``), the model a training run starts
from (``convert``), documents (``documents``), corpora and tokens (``data``), batches and windows
(``windows``), language-model evaluation (``evaluate``).
"""
