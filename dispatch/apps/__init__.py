"""dispatch.apps: the applications built on the dispatch library, apart from the library itself.

    cli      the ``b12x-dual`` command line (one subcommand per module below)
    info     the device, library versions, and which implementation auto picks per format and shape
    demo     all-MiniLM-L6-v2 sentence embeddings quantized per format (model.py, data/)
    sweep    every implementation against the formats/ oracle over a grid of shapes
    bench    timings against bf16 and the device's roofline (bench_plan / bench_run / bench_record)
    _harness what sweep and bench share: implementations as registry backends, inputs, metrics, output

They use only the library's public API (``dispatch``, ``dispatch.api``, ``dispatch.registry``,
``dispatch.policy``, ``dispatch.devices``, ``dispatch.quant_linear``) and the kernel packages' public
functions; the library never imports them.
"""
