// The talk page: microphone → Realtime session → transcript, answer text and the answer's speech.
"use strict";

const SESSION_RATE = 24000;      // the Realtime API's PCM16 rate, for input and output
const body = document.body;
const $ = (id) => document.getElementById(id);

// What the page has heard, said and played; the browser tests read it.
const state = window.metronomeState =
  { heard: [], said: [], sentChunks: 0, ticks: 0, playedSamples: 0, errors: [], connected: false };

let socket = null, audio = null, capture = null, micStream = null;
let playhead = 0, playing = [], answerEl = null, answerText = "", misses = 0;

const authRequired = body.dataset.authRequired === "true";
if (authRequired) $("key-needed").hidden = false;
$("model").textContent = body.dataset.model || "";
$("talk").addEventListener("click", () => (socket ? stop() : start()));

function setStatus(text) { $("status").textContent = text; }

function addTurn(cls, text) {
  const el = document.createElement("div");
  el.className = "turn " + cls;
  el.textContent = text;
  $("conversation").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

function toBase64(buffer) {
  const bytes = new Uint8Array(buffer);
  let text = "";
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

function fromBase64(text) {
  const raw = atob(text);
  const bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes.buffer;
}

async function start() {
  $("talk").disabled = true;
  setStatus("opening the microphone…");
  try {
    audio = new AudioContext({ sampleRate: SESSION_RATE });
    micStream = await navigator.mediaDevices.getUserMedia(
      { audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true } });
    await audio.audioWorklet.addModule("/page/capture-worklet.js");
  } catch (err) {
    fail("microphone unavailable: " + err.message);
    return;
  }
  const url = (location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/realtime";
  // A browser cannot set an Authorization header on a WebSocket: the key goes as a subprotocol, as with
  // OpenAI's browser clients (the server echoes "realtime").
  const key = authRequired ? $("api-key").value.trim() : "";
  if (authRequired && !key) { fail("enter the server's API key first"); return; }
  try {
    socket = key ? new WebSocket(url, ["realtime", "openai-insecure-api-key." + key]) : new WebSocket(url);
  } catch (err) {
    fail("cannot connect: " + err.message);     // e.g. a key with characters a subprotocol cannot carry
    return;
  }
  socket.onopen = () => {
    state.connected = true;
    socket.send(JSON.stringify({ type: "session.update", session: {
      type: "realtime",
      audio: { input: { format: { type: "audio/pcm", rate: SESSION_RATE } },
               output: { format: { type: "audio/pcm", rate: SESSION_RATE } } } } }));
    const source = audio.createMediaStreamSource(micStream);
    capture = new AudioWorkletNode(audio, "pcm16-capture");
    capture.port.onmessage = (e) => {
      if (socket && socket.readyState === WebSocket.OPEN) {
        socket.send(JSON.stringify({ type: "input_audio_buffer.append", audio: toBase64(e.data) }));
        state.sentChunks++;
      }
    };
    source.connect(capture);
    capture.connect(audio.destination);     // a node off the graph's path to the speakers is never run; it outputs silence
    $("talk").textContent = "Stop";
    $("talk").classList.add("live");
    $("talk").disabled = false;
    setStatus("listening");
  };
  socket.onmessage = (e) => onEvent(JSON.parse(e.data));
  socket.onclose = (e) => {
    if (socket) fail(e.reason ? "session closed: " + e.reason : "session closed (" + e.code + ")");
  };
}

function stop() {
  const s = socket;
  socket = null;
  if (s) s.close(1000, "bye");
  if (capture) capture.disconnect();
  if (micStream) micStream.getTracks().forEach((t) => t.stop());
  if (audio) audio.close();
  capture = micStream = audio = null;
  state.connected = false;
  $("talk").textContent = "Start talking";
  $("talk").classList.remove("live");
  $("talk").disabled = false;
  setStatus("not connected");
}

function fail(message) {
  state.errors.push(message);
  addTurn("error", message);
  stop();
  setStatus(message);
}

function stopPlayback() {
  playing.forEach((node) => { try { node.stop(); } catch (_) { /* already ended */ } });
  playing = [];
  playhead = 0;
}

function play(buffer, rate) {
  if (!audio) return;
  const pcm = new Int16Array(buffer);
  const clip = audio.createBuffer(1, pcm.length, rate || SESSION_RATE);
  const samples = clip.getChannelData(0);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 0x8000;
  const node = audio.createBufferSource();
  node.buffer = clip;
  node.connect(audio.destination);
  playhead = Math.max(playhead, audio.currentTime + 0.05);
  node.start(playhead);
  playhead += clip.duration;
  node.onended = () => { playing = playing.filter((n) => n !== node); };
  playing.push(node);
  state.playedSamples += pcm.length;
}

function onEvent(event) {
  switch (event.type) {
    case "input_audio_buffer.speech_started":
      setStatus("hearing you…");
      stopPlayback();                       // barge-in: the answer's speech stops at once
      break;
    case "input_audio_buffer.speech_stopped":
      setStatus("thinking…");
      break;
    case "conversation.item.input_audio_transcription.completed":
      if (event.transcript) { state.heard.push(event.transcript); addTurn("user", event.transcript); }
      break;
    case "response.created":
      answerText = "";
      answerEl = addTurn("assistant", "…");
      break;
    case "response.output_text.delta":       // the spoken answer's transcript comes as text deltas too
      if (!answerEl) answerEl = addTurn("assistant", "");
      answerText += event.delta;
      answerEl.textContent = answerText;
      break;
    case "response.output_audio.delta":
      play(fromBase64(event.delta), event.sample_rate);
      setStatus("speaking");
      break;
    case "response.done":
      if (answerEl) {
        state.said.push(answerText);
        if (event.response && event.response.status === "cancelled") answerEl.classList.add("cancelled");
      }
      answerEl = null;
      setStatus("listening");
      break;
    case "metronome.tick":
      state.ticks++;
      $("latency").value = Math.min(1, event.latency_ms / event.budget_ms);
      $("latency-text").textContent = event.latency_ms.toFixed(0) + " / " + event.budget_ms.toFixed(0) + " ms";
      if (!event.deadline_met) $("misses").textContent = String(++misses);
      if (event.kv_blocks_total) {
        $("kv").value = event.kv_blocks_used / event.kv_blocks_total;
        $("kv-text").textContent = event.kv_blocks_used + " / " + event.kv_blocks_total + " blocks";
      }
      break;
    case "error":
      state.errors.push(event.error.message);
      addTurn("error", event.error.message);
      break;
  }
}
