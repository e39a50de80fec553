"""`ray job submit --working-dir . -- python jobs/validate.py ARGS`: same arguments as `dflash-ray validate`."""

from _entry import run

if __name__ == "__main__":
    run("validate")
