FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY reval reval
COPY buffer buffer
COPY learner learner
COPY rollout rollout
COPY services services
COPY configs configs
RUN pip install --no-cache-dir . 
ENTRYPOINT []
