"""`ray job submit --working-dir . -- python jobs/generate.py ARGS`: same arguments as `dflash-ray generate`."""

from _entry import run

if __name__ == "__main__":
    run("generate")
