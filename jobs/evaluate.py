"""`ray job submit --working-dir . -- python jobs/evaluate.py ARGS`: same arguments as `dflash-ray evaluate`."""

from _entry import run

if __name__ == "__main__":
    run("evaluate")
