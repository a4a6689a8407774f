"""`python -m colibri_model.cli` (and `torchrun -m colibri_model.cli`): the `colibri-model` command."""

from . import main

if __name__ == "__main__":
    main()
