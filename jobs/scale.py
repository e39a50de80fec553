"""`ray job submit --working-dir . -- python jobs/scale.py ARGS`: same arguments as `dflash-ray scale`."""

from _entry import run

if __name__ == "__main__":
    run("scale")
