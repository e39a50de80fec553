"""`ray job submit --working-dir . -- python jobs/selfprompt.py ARGS`: same arguments as `dflash-ray selfprompt`."""

from _entry import run

if __name__ == "__main__":
    run("selfprompt")
