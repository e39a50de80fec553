"""`ray job submit --working-dir . -- python jobs/responses.py --input URI --output URI`: existing
responses as completions, same arguments as `dflash-ray responses`."""

from _entry import run

if __name__ == "__main__":
    run("responses")
