"""The HTTP gateway (API.md §1-§2): the only public process of dramaturg.

    app.py            the FastAPI app: lifespan (channels, voices, prompt builder), middleware, routers
    routes/           speech (/v1/audio/speech, /v1/tts), voices, models, takes, health, playground
    validation.py     strict body parsing and field readers;  schemas.py  the two speech requests
    orchestrator.py   voices, takes, Codec.Encode and the prompt -> a Backbone.Generate request
    session.py        one Generate stream + one Decode stream per request
    responses.py      progressive, buffered and SSE bodies; disconnects cancel the session
    audio.py          time-stretch, gain, streaming resampler and the six containers
    stages.py         gRPC channels, readiness, status -> HTTP mapping, wire layouts
    prompt.py, chunking.py, normalize.py   the prompt builder (token ids from text)
"""
