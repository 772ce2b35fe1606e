package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io/fs"
	"os"
)

// preparedDevice and preparedClaim are what the checkpoint keeps of a prepared claim: enough to
// answer a repeated prepare and to undo it without the ResourceClaim.
type preparedDevice struct {
	Request string `json:"request"`
	Pool    string `json:"pool"`
	Device  string `json:"device"`
	ShareID string `json:"shareID,omitempty"`
}

type preparedClaim struct {
	Namespace string           `json:"namespace"`
	Name      string           `json:"name"`
	Devices   []preparedDevice `json:"devices"`
}

type checkpointState struct {
	Claims map[string]preparedClaim `json:"claims"`
}

// checkpointFile is one file that holds every prepared claim, with a checksum of its contents.
// Each change rewrites the whole file, durably.
type checkpointFile struct {
	path string
}

type checkpointEnvelope struct {
	Version  int             `json:"version"`
	Checksum uint32          `json:"checksum"`
	Data     json.RawMessage `json:"data"`
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

func (c checkpointFile) load() (checkpointState, error) {
	state := checkpointState{Claims: map[string]preparedClaim{}}
	raw, err := os.ReadFile(c.path)
	if errors.Is(err, fs.ErrNotExist) {
		return state, nil
	}
	if err != nil {
		return state, fmt.Errorf("read the checkpoint: %w", err)
	}
	var env checkpointEnvelope
	if err := json.Unmarshal(raw, &env); err != nil {
		return state, fmt.Errorf("checkpoint %s: %w", c.path, err)
	}
	if env.Version != 1 || crc32.Checksum(env.Data, castagnoli) != env.Checksum {
		return state, fmt.Errorf("checkpoint %s: unknown version or bad checksum", c.path)
	}
	if err := json.Unmarshal(env.Data, &state); err != nil {
		return state, fmt.Errorf("checkpoint %s: %w", c.path, err)
	}
	if state.Claims == nil {
		state.Claims = map[string]preparedClaim{}
	}
	return state, nil
}

func (c checkpointFile) store(state checkpointState) error {
	data, err := json.Marshal(state)
	if err != nil {
		return err
	}
	out, err := json.Marshal(checkpointEnvelope{Version: 1, Checksum: crc32.Checksum(data, castagnoli), Data: data})
	if err != nil {
		return err
	}
	return writeAtomically(c.path, out, 0o600)
}
