# memproxy as a container: slim Python, a non-root user, the SQLite database on a volume.
#   docker build -t memproxy .
#   docker run -p 8080:8080 -v memproxy-data:/data -e MEMPROXY_API_KEY=... -e OPENAI_API_KEY=... memproxy
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    LITELLM_LOCAL_MODEL_COST_MAP=True

RUN useradd --create-home --uid 10001 memproxy \
    && mkdir -p /data \
    && chown memproxy:memproxy /data

WORKDIR /app
COPY pyproject.toml README.md ./
COPY memproxy ./memproxy
RUN pip install .
COPY deploy/docker.yaml /etc/memproxy/config.yaml

USER memproxy
VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK --interval=30s --timeout=3s --start-period=20s --retries=3 \
    CMD python -c "import urllib.request,sys; sys.exit(urllib.request.urlopen('http://127.0.0.1:8080/healthz', timeout=2).status != 200)"

CMD ["memproxy", "serve", "-c", "/etc/memproxy/config.yaml"]
