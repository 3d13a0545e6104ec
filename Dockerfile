# Sluicegate gateway image: slim, non-root, `sluicegate serve` as the entrypoint.
# The full image has the C compiler mypyc needs for the request path's modules (setup.py).
FROM python:3.11 AS build
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY gateway gateway
COPY transports transports
COPY loadtest loadtest
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /nonexistent --shell /usr/sbin/nologin sluicegate
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
COPY config /etc/sluicegate
USER 10001
# 8080: the public port (server.port). 9090: the admin listener (admin.port: /admin/*, /metrics), which
# binds 127.0.0.1 unless the config sets admin.host: 0.0.0.0 (as config/kubernetes/ does, for Prometheus).
EXPOSE 8080 9090
ENTRYPOINT ["sluicegate", "serve"]
CMD ["--config", "/etc/sluicegate/example.yaml", "--host", "0.0.0.0"]
