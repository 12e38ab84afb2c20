"""The OpenAI Realtime API (GA event set) over WebSocket: the session and its client and server events, and the
server VAD (Silero through onnxruntime) that finds the user's turns in the streamed input audio."""
