"""`ray job submit --working-dir . -- python jobs/tokenize.py ARGS`: same arguments as `dflash-ray tokenize`."""

from _entry import run

if __name__ == "__main__":
    run("tokenize")
