"""Adapters for training frameworks, one module per framework, each importing its framework only when used.

    gafused.integrations.accelerate     Hugging Face Accelerate     pip install "gafused[accelerate]"
    gafused.integrations.transformers   transformers' Trainer       pip install "gafused[transformers]"
    gafused.integrations.lightning      Lightning                   pip install "gafused[lightning]"

Importing this package imports none of them; importing a module imports its framework and says how to install
it when it is missing.
"""

# The oldest transformers whose Trainer has every internal GafusedTrainer builds on (Trainer.loss_is_scaled_for_ga
# arrived in 5.19.0); setup.py's extra asks for it and the transformers tests skip below it.
TRANSFORMERS_MIN_VERSION = "5.19"
