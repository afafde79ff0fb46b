"""Multi-process and SIGKILL scenarios of the store, as plain parameterised functions.

Used by: ``tests/store/test_multiprocess.py``, ``tests/store/test_crash.py``
and ``tests/test_live_compaction.py`` (quick forms), ``tests/stress/test_stress.py``
(long forms, also an argparse script) and the fault suite (tests/faults).
No pytest here: a scenario raises ``AssertionError`` naming what broke, the seed
and the trial, and returns a summary dict the callers print or assert on.

Every block's bytes are a pure function of its key (tests/support/blocks.py), so
any process can verify what it reads without talking to the writer.

    oracles      - SPEC (the scenarios' namespace), do_put(), verify_store(),
                   read_and_verify(): what every scenario checks
    multiprocess - run_multiprocess(): N spawned workers put/lookup/read one
                   small cache; until_exercised()
    multiprocess_worker - what one of those workers does
    crash        - run_crash_trials(): a writer SIGKILLed at random or chosen
                   publish points; run_live_creator_eviction_crash()
    crash_plan   - the publish phases, CrashTrial and the plans of kills
                   (random_plan(), targeted_plan(), mixed_plan()), and the hooks
                   that stop a child in a phase
"""
