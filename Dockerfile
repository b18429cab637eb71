# kvroute router image: slim Python, non-root, `kvroute serve` as the entry point.
#   docker build -t kvroute .
#   docker run -p 8000:8000 kvroute serve --host 0.0.0.0 --worker http://vllm-0:8000
FROM python:3.11-slim AS build
# A C compiler and the xxHash headers for the compiled modules (setup.py: chain walk, key chain, event loops).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libxxhash-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY kvroute_pkg ./kvroute_pkg
COPY router ./router
COPY indexer ./indexer
COPY policies ./policies
COPY sim ./sim
# aiohttp is the faster upstream client (docs/benchmarks.md); httpx stays as the fallback.
RUN pip install --no-cache-dir --prefix=/install . aiohttp

FROM python:3.11-slim
RUN apt-get update && apt-get install -y --no-install-recommends libxxhash0 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 kvroute
COPY --from=build /install /usr/local
USER kvroute
WORKDIR /home/kvroute
EXPOSE 8000 9002
ENV PYTHONUNBUFFERED=1
HEALTHCHECK --interval=10s --timeout=2s CMD ["python", "-c", "import urllib.request,sys; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2).status == 200 else 1)"]
ENTRYPOINT ["kvroute"]
CMD ["serve", "--host", "0.0.0.0", "--port", "8000", "--config", "/etc/kvroute/kvroute.yaml"]
