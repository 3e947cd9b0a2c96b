"""Between the web process and the inference worker, imported by both: the typed messages
(`wire`), the client a request holds (`client`), the routing among several workers (`cluster`),
the process's client and worker start-up (`runtime`) and the request deadline (`deadline`).
Imports no API surface."""
