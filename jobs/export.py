"""`ray job submit --working-dir . -- python jobs/export.py ARGS`: same arguments as `dflash-ray export`."""

from _entry import run

if __name__ == "__main__":
    run("export")
