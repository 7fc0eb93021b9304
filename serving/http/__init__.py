"""HTTP/REST on its own port (uvicorn + Starlette): KServe v2 with the binary-data extension,
Triton's generate endpoints and an OpenAI-compatible API, over the same engines as gRPC."""
