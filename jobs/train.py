"""`ray job submit --working-dir . -- python jobs/train.py ARGS`: same arguments as `dflash-ray train`."""

from _entry import run

if __name__ == "__main__":
    run("train")
