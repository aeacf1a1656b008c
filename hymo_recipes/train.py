"""The training entry point, ``python -m hymo_recipes.train`` (run_train.sh's TRAIN_FILE): see
hymo_recipes/titan/train.py."""

from hymo_recipes.titan.train import main

if __name__ == "__main__":
    main()
