"""The REST server: ``app.create_app(engine)`` translates HTTP to engine calls and
``serve.serve(data_dir, ...)`` runs it under uvicorn.

Nothing is imported here, so ``branchbox.server.address`` (which the SDK reads)
costs no FastAPI import.
"""
