"""The wire layer: the only part of serving that knows gRPC and protobuf.

protocol (protobuf <-> numpy, and the one table from engine errors to status codes), servicer
(the thin KServe v2 servicer: convert the request, call the engine, convert back), and the
generated stubs (_generated, made by gen_protos from protos/inference.proto)."""
