// The voice panel: one spoken turn through three routes (transcribe, answer, speak), declared as
// one workflow (x-hypnos-workflow, spec §1) so its end-to-end time lands in the memory status's
// latency.workflows, each request naming the model the next one needs (x-hypnos-next-model).
// The microphone is read as PCM with WebAudio and sent as a 16 kHz 16-bit WAV, the format every
// speech-to-text model reads reliably.
import { apiFetch, apiJSON, errorOf, modelsWith } from "./api.js";
import { field, formatMs, h, modelSelect, uid, unavailable } from "./ui.js";

export const WORKFLOW = "playground-voice";
const SAMPLE_RATE = 16000;
const SYSTEM_PROMPT =
  "You are a voice assistant. Answer in one or two short spoken sentences, without lists or markup.";
const HISTORY_MESSAGES = 6;

function turnId() {
  if (globalThis.crypto?.randomUUID) return crypto.randomUUID();
  return Array.from({ length: 4 }, () => Math.random().toString(16).slice(2, 10)).join("");
}

// -- capture ---------------------------------------------------------------------------------

class Recorder {
  constructor(onProgress) {
    this.onProgress = onProgress;
    this.chunks = [];
    this.samples = 0;
  }

  async start() {
    this.stream = await navigator.mediaDevices.getUserMedia({
      // Noise suppression and gain control reshape speech in ways the speech-to-text models were
      // not trained on; echo cancellation stays, for a turn recorded next to the speakers.
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: false, autoGainControl: false },
    });
    this.context = new AudioContext();
    // A context made after an await may start suspended (autoplay policy); the click allows it.
    await this.context.resume();
    const source = this.context.createMediaStreamSource(this.stream);
    // ScriptProcessorNode runs everywhere without a worklet module file; its latency does not
    // matter for a recording that is sent once it ends.
    this.node = this.context.createScriptProcessor(4096, 1, 1);
    this.node.onaudioprocess = (event) => {
      const channel = event.inputBuffer.getChannelData(0);
      this.chunks.push(new Float32Array(channel));
      this.samples += channel.length;
      this.onProgress(this.samples / this.context.sampleRate);
    };
    // The processor only runs when connected to the output; a silent gain keeps the microphone
    // out of the speakers.
    const mute = this.context.createGain();
    mute.gain.value = 0;
    source.connect(this.node);
    this.node.connect(mute);
    mute.connect(this.context.destination);
  }

  async stop() {
    this.node.disconnect();
    for (const track of this.stream.getTracks()) track.stop();
    const rate = this.context.sampleRate;
    await this.context.close();
    const all = new Float32Array(this.samples);
    let offset = 0;
    for (const chunk of this.chunks) {
      all.set(chunk, offset);
      offset += chunk.length;
    }
    return encodeWav(resample(all, rate, SAMPLE_RATE), SAMPLE_RATE);
  }
}

// Averaging decimation: each output sample is the mean of the input samples it covers, which
// also filters what would alias above the new Nyquist frequency.
function resample(input, from, to) {
  if (from === to) return input;
  const ratio = from / to;
  const output = new Float32Array(Math.floor(input.length / ratio));
  for (let i = 0; i < output.length; i++) {
    const start = Math.floor(i * ratio);
    const end = Math.max(start + 1, Math.floor((i + 1) * ratio));
    let sum = 0;
    for (let j = start; j < end; j++) sum += input[j];
    output[i] = sum / (end - start);
  }
  return output;
}

function encodeWav(samples, rate) {
  const buffer = new ArrayBuffer(44 + samples.length * 2);
  const view = new DataView(buffer);
  const text = (offset, value) => [...value].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  text(0, "RIFF");
  view.setUint32(4, 36 + samples.length * 2, true);
  text(8, "WAVE");
  text(12, "fmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true); // PCM
  view.setUint16(22, 1, true); // mono
  view.setUint32(24, rate, true);
  view.setUint32(28, rate * 2, true);
  view.setUint16(32, 2, true);
  view.setUint16(34, 16, true);
  text(36, "data");
  view.setUint32(40, samples.length * 2, true);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    view.setInt16(44 + i * 2, s < 0 ? s * 0x8000 : s * 0x7fff, true);
  }
  return new Blob([buffer], { type: "audio/wav" });
}

// -- the turn --------------------------------------------------------------------------------

async function timed(timings, step, work) {
  const started = performance.now();
  try {
    return await work();
  } finally {
    timings[step] = Math.round(performance.now() - started);
  }
}

// Transcribe, answer, speak: the three requests of one declared workflow, the last one closing it.
async function runTurn(audio, choice, history, show) {
  const workflow = { "x-hypnos-workflow": `${WORKFLOW}/${turnId()}` };
  const timings = {};
  const form = new FormData();
  form.append("model", choice.transcription);
  form.append("file", audio, "turn.wav");
  show.step("Transcribing…");
  const transcript = await timed(timings, "transcribe", async () => {
    const headers = { ...workflow, "x-hypnos-next-model": choice.chat };
    const result = await apiJSON("v1/audio/transcriptions", form, { headers });
    return (result.text || "").trim();
  });
  show.transcript(transcript, timings);
  if (!transcript) throw new Error("Nothing was heard in the recording.");

  show.step("Answering…");
  const asked = { role: "user", content: transcript };
  const answer = await timed(timings, "answer", async () => {
    const headers = { ...workflow, "x-hypnos-next-model": choice.speech };
    const messages = [{ role: "system", content: SYSTEM_PROMPT }, ...history.slice(-HISTORY_MESSAGES), asked];
    const result = await apiJSON("v1/chat/completions", { model: choice.chat, messages, max_tokens: 120 }, { headers });
    return (result.choices?.[0]?.message?.content || "").trim();
  });
  history.push(asked, { role: "assistant", content: answer });
  show.answer(answer, timings);

  show.step("Speaking…");
  const speech = await timed(timings, "speak", async () => {
    const headers = { ...workflow, "x-hypnos-workflow-end": "true", "content-type": "application/json" };
    const input = answer || "I have no answer.";
    const body = JSON.stringify({ model: choice.speech, input, voice: choice.voice, response_format: "wav" });
    const response = await apiFetch("v1/audio/speech", { method: "POST", body, headers });
    if (!response.ok) throw await errorOf(response);
    return response.blob();
  });
  show.speech(speech, timings);
}

// -- the panel -------------------------------------------------------------------------------

function namedSelect(models, name) {
  const select = modelSelect([["", models]]);
  select.name = name;
  return select;
}

export async function mount(element) {
  const [listeners, talkers, speakers] = await Promise.all([
    modelsWith("transcription"),
    modelsWith("chat"),
    modelsWith("speech"),
  ]);
  const missing = [
    [listeners, "speech-to-text"],
    [talkers, "chat"],
    [speakers, "text-to-speech"],
  ].filter(([models]) => !models.length);
  if (missing.length) {
    const names = missing.map(([, name]) => name).join(", ");
    unavailable(element, `A voice turn needs a ${names} model; this server serves none.`);
    return;
  }
  const transcription = namedSelect(listeners, "transcription");
  const chat = namedSelect(talkers, "chat");
  const speech = namedSelect(speakers, "speech");
  const voice = h("input", { type: "text", name: "voice", value: "alloy", autocomplete: "off" });
  const record = h("button", { type: "button", class: "primary voice-record", "aria-pressed": "false" }, "Record");
  // Not a live region: it changes ten times a second; the status line says when listening starts.
  const level = h("span", { class: "voice-level", dataset: { seconds: "0" } });
  const upload = h("input", { type: "file", name: "audio", accept: "audio/*" });
  const send = h("button", { type: "button" }, "Send the file");
  const status = h("p", { class: "status voice-status", role: "status", "aria-live": "polite" });
  const transcriptText = h("p", { class: "voice-transcript", id: uid("voice") });
  const answerText = h("p", { class: "voice-answer", id: uid("voice") });
  const player = h("audio", { class: "voice-audio", controls: true, "aria-label": "The spoken answer" });
  const timingList = h("dl", { class: "voice-timings", "aria-label": "Timings of the turn" });

  element.append(
    h(
      "div",
      { class: "voice-panel" },
      h(
        "div",
        { class: "row" },
        field("Speech-to-text model", transcription),
        field("Chat model", chat),
        field("Speech model", speech),
        field("Voice", voice),
      ),
      h("div", { class: "row voice-controls" }, record, level),
      h("div", { class: "row" }, field("Or an audio file", upload), send),
      status,
      h("h3", { id: `${transcriptText.id}-h` }, "You said"),
      transcriptText,
      h("h3", { id: `${answerText.id}-h` }, "Answer"),
      answerText,
      player,
      timingList,
    ),
  );
  transcriptText.setAttribute("aria-labelledby", `${transcriptText.id}-h`);
  answerText.setAttribute("aria-labelledby", `${answerText.id}-h`);

  const history = [];
  let recorder = null;
  let objectUrl = null;
  const showTimings = (timings) => {
    const rows = [
      ["transcribe", "Transcribe"],
      ["answer", "Answer"],
      ["speak", "Speak"],
    ].filter(([key]) => key in timings);
    const total = rows.reduce((sum, [key]) => sum + timings[key], 0);
    if (rows.length === 3) rows.push(["total", "Whole turn"]);
    timingList.replaceChildren(
      ...rows.flatMap(([key, label]) => [
        h("dt", {}, label),
        h("dd", { dataset: { step: key } }, formatMs(key === "total" ? total : timings[key])),
      ]),
    );
  };
  const show = {
    step: (text) => (status.textContent = text),
    transcript: (text, timings) => {
      transcriptText.textContent = text || "(nothing heard)";
      showTimings(timings);
    },
    answer: (text, timings) => {
      answerText.textContent = text;
      showTimings(timings);
    },
    speech: (blob, timings) => {
      if (objectUrl) URL.revokeObjectURL(objectUrl);
      objectUrl = URL.createObjectURL(blob);
      player.src = objectUrl;
      showTimings(timings);
      status.textContent = "Done.";
      // Autoplay may be refused (no gesture since the recording); the controls still play it.
      player.play().catch(() => {});
    },
  };
  const busy = (on) => {
    record.disabled = on;
    send.disabled = on;
  };
  const turn = async (audio) => {
    busy(true);
    status.classList.remove("error");
    transcriptText.textContent = "";
    answerText.textContent = "";
    timingList.replaceChildren();
    const choice = {
      transcription: transcription.value,
      chat: chat.value,
      speech: speech.value,
      voice: voice.value || "alloy",
    };
    try {
      await runTurn(audio, choice, history, show);
    } catch (error) {
      status.textContent = `The turn failed: ${error.message}`;
      status.classList.add("error");
    } finally {
      busy(false);
    }
  };

  record.addEventListener("click", async () => {
    if (!recorder) {
      recorder = new Recorder((seconds) => {
        level.dataset.seconds = seconds.toFixed(1);
        level.textContent = `Recording… ${seconds.toFixed(1)} s`;
      });
      try {
        await recorder.start();
      } catch (error) {
        recorder = null;
        status.textContent = `The microphone is not available: ${error.message}`;
        status.classList.add("error");
        return;
      }
      record.textContent = "Stop and send";
      record.setAttribute("aria-pressed", "true");
      send.disabled = true;
      status.classList.remove("error");
      status.textContent = "Listening. Press the button again when you are done.";
      return;
    }
    const finished = recorder;
    recorder = null;
    record.textContent = "Record";
    record.setAttribute("aria-pressed", "false");
    level.textContent = "";
    await turn(await finished.stop());
  });
  send.addEventListener("click", () => {
    const file = upload.files[0];
    if (!file) {
      status.textContent = "Choose an audio file first.";
      upload.focus();
      return;
    }
    turn(file);
  });
}
