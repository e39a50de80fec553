"""`ray job submit --working-dir . -- python jobs/resume.py ARGS`: same arguments as `dflash-ray resume`."""

from _entry import run

if __name__ == "__main__":
    run("resume")
