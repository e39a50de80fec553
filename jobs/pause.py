"""`ray job submit --working-dir . -- python jobs/pause.py ARGS`: same arguments as `dflash-ray pause`."""

from _entry import run

if __name__ == "__main__":
    run("pause")
