"""`ray job submit --working-dir . -- python jobs/status.py ARGS`: same arguments as `dflash-ray status`."""

from _entry import run

if __name__ == "__main__":
    run("status")
