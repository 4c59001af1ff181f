"""Entry point of one test rank: ``run_worker.py module:function json-arg``."""

import faulthandler
import importlib
import json
import os
import sys

faulthandler.enable()
faulthandler.dump_traceback_later(float(os.environ.get("WORKER_STACK_DUMP_AFTER", "55")),
                                  exit=False)
module, _, func = sys.argv[1].partition(":")
arg = json.loads(sys.argv[2])
getattr(importlib.import_module(module), func)(arg)
faulthandler.cancel_dump_traceback_later()
